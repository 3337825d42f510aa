"""The Triton implementation of the spec (Hopper first), and each kernel's host launcher.

Importing it imports every module of it and fixes their Triton compile-cache keys in one order
(:mod:`mlaspec.impl.compile_keys`), so that every process finds in the cache what another compiled.
"""

from .compile_keys import settle

settle()
