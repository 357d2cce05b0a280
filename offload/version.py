"""offload's version (pyproject.toml's), in a file of its own: code below the package's face (a checkpoint's
manifest) reads it without importing offload/__init__.py, which stands above everything it names."""
__version__ = "0.1.0"
