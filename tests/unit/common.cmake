# Unit tests: common
