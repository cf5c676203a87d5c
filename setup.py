"""Build hook: compiles native/ through cffi's out-of-line API mode (see native/build_verifier.py)."""

from setuptools import setup

setup(cffi_modules=["native/build_verifier.py:ffibuilder"])
