"""The ``lowbit`` command. Importing it (and ``lowbit --help``) must not import torch."""
