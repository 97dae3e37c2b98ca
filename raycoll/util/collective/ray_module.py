"""Ray's own ``ray.util.collective``, with backend ``"raycoll"`` registered wherever it is used.

``import raycoll.util.collective.ray_module as col`` gives Ray's module itself (its
functions, its group manager, its semantics: these are the same objects as
``ray.util.collective``'s), and registers backend ``"raycoll"`` (:mod:`.ray_group`) in the
process that imports it. Ray ships the code of an actor class defined in a script or a test
file by value, so the actor's process never runs that file's imports: it imports only the
modules the methods refer to. A method that calls ``col.allreduce(...)`` refers to this
module, so the actor imports it, and the backend is registered there before the first
collective, with no call in the actor. (``import ray.util.collective as col`` needs raycoll
imported in the actor, or ``register()`` there, or Ray's ``worker_process_setup_hook``.)
"""

from ray.util.collective import *  # noqa: F401,F403 - Ray's module, re-exported as it is
from ray.util.collective import __all__ as _ray_all
from ray.util.collective import types  # noqa: F401 - col.types, as Ray's module has it

from raycoll.util.collective.ray_group import register

register()

__all__ = list(_ray_all) + ["types", "register"]
