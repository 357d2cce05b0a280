"""Copy / cast / flatten kernels (csrc/copy) and their plain-torch references."""
__all__: list[str] = []
