"""Importing this registers the toy.* ops (for `python -m recipes.verify_kernels --import tests.toy_kernels_plugin`)."""

from tests.toy_kernels import register_toys

register_toys()
