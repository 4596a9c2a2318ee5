"""Creates one Accelerator from the settings it is launched with, and nothing else (an error in
those settings must name where they came from)."""

from lowbit import Accelerator

Accelerator()
