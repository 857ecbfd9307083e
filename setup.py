"""Package discovery for the mapped layout; every other setting is in pyproject.toml.

The code folders install under the `specboost` namespace (`training/` -> `specboost.training`,
...). setuptools' `packages.find` cannot add that prefix, so every package below a mapped folder
is found here: a subpackage added later ships without anyone listing it. Folders of data files
(`training/configs/`, `data/prompts/`) count as namespace packages, so their files ship as package
data; the corpus only builds the reference LLM and stays in the checkout.
"""

from setuptools import find_namespace_packages, setup

PACKAGE_DIR = {
    "specboost": "specboost",
    "specboost.training": "training",
    "specboost.speculator": "speculator",
    "specboost.decoder": "decoder",
    "specboost.data": "data",
}
LEFT_OUT = ["corpus", "corpus.*", "*__pycache__*"]

packages = [
    *PACKAGE_DIR,
    *(
        f"{name}.{sub}"
        for name, folder in PACKAGE_DIR.items()
        for sub in find_namespace_packages(folder, exclude=LEFT_OUT)
    ),
]

setup(package_dir=PACKAGE_DIR, packages=packages)
