from moetool.cli import app  # noqa: F401
