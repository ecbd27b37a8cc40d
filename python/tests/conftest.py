"""pytest's setup of the kvstream tests: torch, where installed, is imported before any test
loads kvstream's native module. That module links the system's NCCL (libnccl.so.2) when
kvstream was built with it, and a torch imported after it binds to that library instead of
the newer one it ships, failing with an undefined NCCL symbol (docs/python.md)."""

try:
    import torch  # noqa: F401
except ImportError:  # the tests that need torch skip saying so
    pass
