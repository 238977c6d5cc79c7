"""moetool: convert Mixture-of-Experts checkpoints and prove the result is right."""
from moetool.errors import MoetoolError

__version__ = "0.1.0"
__all__ = ["MoetoolError", "__version__"]
