"""arctic_zorro_train."""

__version__ = "0.1.0"

__all__ = ["__version__"]
