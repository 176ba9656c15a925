"""``python -m hetrain`` runs the command line (:func:`hetrain.cli.main`)."""

from hetrain.cli import main

if __name__ == "__main__":
    main()
