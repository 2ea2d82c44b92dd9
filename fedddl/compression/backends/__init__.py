"""Speed back ends: numpy, numba (:mod:`.jit`), torch on devices (:mod:`.device_path`) and
threads (:mod:`.parallel`); bit-identical results whichever runs. Leaves: they import
nothing from :mod:`fedddl.compression.algorithms` or :mod:`fedddl.compression.codecs`."""
