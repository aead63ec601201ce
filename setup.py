"""Build hook: a wheel carries the shipped configs (``configs/*.yaml``) in ``jaxrl/configs/``, so
``jaxrl.configs.path(name)`` finds them in a non-editable install. Everything else is in
pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithConfigs(build_py):
    """``build_py`` plus a copy of ``configs/*.yaml`` into the built ``jaxrl/configs``."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "jaxrl" / "configs"
        target.mkdir(parents=True, exist_ok=True)
        for source in sorted(Path(__file__).resolve().parent.glob("configs/*.yaml")):
            self.copy_file(str(source), str(target / source.name))


setup(cmdclass={"build_py": BuildWithConfigs})
