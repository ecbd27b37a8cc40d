# Unit tests: attention
