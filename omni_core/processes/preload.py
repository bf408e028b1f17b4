"""Imported by the fork server before it forks Omni's processes (:mod:`omni_core.processes`): the libraries
every model process needs, so that no child imports them again. Only libraries: plugins are discovered in each
child, with the caller's environment and ``sys.path``."""

from omni_core.utils.quiet import quiet_optional_libraries

quiet_optional_libraries()  # before the imports below: their import is the noise

import torch  # noqa: E402
import torch.distributed  # noqa: E402,F401
import torch.multiprocessing  # noqa: E402,F401  (its reductions rebuild the tensors a child receives)

try:  # the engine's libraries (omni-core[runtime]); a process that runs without them imports what it needs itself
    import diffusers  # noqa: F401
    import transformers  # noqa: F401
    import safetensors.torch  # noqa: F401
except ImportError:
    pass
try:  # what every model process imports next (the runner's hooks): diffusers.hooks pulls peft, transformers'
    # modeling code and torchao -- 1.7 s of each worker's start-up on 2 cores when a child imported them itself
    import diffusers.hooks  # noqa: F401
    import diffusers.models.modeling_utils  # noqa: F401
except ImportError:
    pass

del torch
