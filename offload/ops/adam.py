"""Fused CPU AdamW kernel (csrc/adam) and its plain-torch reference."""
__all__: list[str] = []
