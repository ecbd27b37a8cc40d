# Unit tests: attention_cpu (the CPU attention kernels: golden reference, fast path and its
# instruction-set variants, parameter validation).
kvstream_add_gtest(cpu_attention_test LABELS unit
                   SOURCES cpu_attention_test.cc attention_test_util.h
                   DEPS kvstream::attention)
