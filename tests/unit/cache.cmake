# Unit tests: cache
