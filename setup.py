"""Maps the top-level folders (the architecture) into the one `onecat` namespace."""
from pathlib import Path

from setuptools import find_packages, setup

FOLDERS = {"engine": "onecat.engine", "gates": "onecat.gates", "results": "onecat.results",
           "reports": "onecat.reports", "cli": "onecat.cli", "contracts": "onecat.contracts",
           "training": "onecat.training"}

packages, package_dir = [], {}
for folder, name in FOLDERS.items():
    package_dir[name] = folder
    packages.append(name)
    for sub in find_packages(folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = str(Path(folder, *sub.split(".")))

setup(packages=packages, package_dir=package_dir,
      package_data={"onecat.contracts": ["*.yaml"], "onecat.engine.drafters": ["*/config.json", "*/*.safetensors", "*/draft_vocab.json"]},
      include_package_data=True)
