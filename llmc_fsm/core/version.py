"""The installed llmc-fsm version (also ``llmc_fsm.__version__``)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
