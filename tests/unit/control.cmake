# Unit tests: wire format and control channel
# wire_test includes the deterministic mutation test, which runs in every build (the libFuzzer
# target in tests/fuzz/ needs clang).
kvstream_add_gtest(wire_test LABELS unit SOURCES wire_test.cc DEPS kvstream::transfer)
kvstream_add_gtest(control_channel_test LABELS unit SOURCES control_channel_test.cc
                   DEPS kvstream::transfer)
kvstream_add_gtest(socket_test LABELS unit SOURCES socket_test.cc DEPS kvstream::transfer)
