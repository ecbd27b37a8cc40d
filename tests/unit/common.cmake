# Unit tests: common (numeric conversions, tensor views).
kvstream_add_gtest(numeric_test LABELS unit SOURCES numeric_test.cc DEPS kvstream::common)
kvstream_add_gtest(tensor_test LABELS unit SOURCES tensor_test.cc DEPS kvstream::common)
kvstream_add_gtest(byte_io_test LABELS unit SOURCES byte_io_test.cc DEPS kvstream::common)
kvstream_add_gtest(cublas_status_test LABELS unit SOURCES cublas_status_test.cc DEPS kvstream::common)
