"""``python -m moetool`` and the ``moetool`` command."""


def entry() -> None:
    """The moetool process. Importing torch, typer and the rest makes about 250,000 objects
    that live until exit and no garbage: the collector is off while they are made, and they are
    frozen out of its scans afterwards (otherwise it walks them again and again, about 0.15 s
    of each run)."""
    import gc

    gc.disable()
    from moetool.cli import main
    from moetool import lazy

    lazy.freeze_imports = True  # the same for what a command imports when it runs (moetool.lazy)
    gc.freeze()
    gc.enable()
    main()


if __name__ == "__main__":
    entry()
