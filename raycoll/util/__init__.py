"""raycoll inside Ray's own APIs: :mod:`raycoll.util.collective`, a drop-in for
``ray.util.collective`` (``import raycoll.util.collective as col``)."""
