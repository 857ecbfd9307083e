"""specboost: lossless speculative decoding with a pool of small speculative models.

The code lives in three subpackages (`specboost.training`, `specboost.speculator`,
`specboost.decoder`); bundled prompt sets in `specboost.data`. The version comes from the
installed package's metadata, so a wheel, an editable install and `specboost --version` agree.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("specboost")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
