"""Wire formats: the update message (:mod:`.wire`), the downlink formats
(:mod:`.downlink`), entropy coding (:mod:`.entropy`) and the reusable output buffer
(:mod:`.message_buffer`). They serialise what :mod:`fedddl.compression.algorithms`
produce, with the kernels of :mod:`fedddl.compression.backends`."""
