# Unit tests: attention_cpu
