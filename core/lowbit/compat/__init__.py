"""Accelerate's own names, mapped onto lowbit's: its fp8_backend and distributed-type names, its
config file keys, its handler and plugin classes. The only place of the core that names plugins.
"""
