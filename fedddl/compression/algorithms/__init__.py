"""Compression algorithms (GRACE-sized): the :class:`~.base.Compressor` and
:class:`~.memory.Memory` interfaces, their implementations, the payloads they produce and
the registry. They use :mod:`fedddl.compression.backends` and know no wire format."""
