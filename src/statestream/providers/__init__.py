"""State providers: one per kind of array state, same shape for each framework.

``array_provider_for(obj)`` finds the provider of a value to save,
``target_provider_for(like)`` the provider a target leaf asks for, and
``provider_by_kind(kind)`` the one a checkpoint recorded. State adapters
(:class:`StateAdapter`, :func:`register_adapter`) save values that are not
arrays as small trees: random generators, typed JAX keys, compiled modules. Framework code
(torch, JAX) lives only in its provider module; a new framework is one
:class:`ArrayProvider` passed to :func:`register_provider`.
"""

from __future__ import annotations

from statestream.providers._adapters import (
    StateAdapter,
    adapter_by_name,
    adapter_for,
    adapters,
    register_adapter,
)
from statestream.providers._base import (
    ArrayProvider,
    Destination,
    PreparedArray,
    ProviderCapabilities,
    box_slices,
    chunk_of_host_array,
    find_box,
)
from statestream.providers._registry import (
    array_provider_for,
    module_provider_for,
    optimizer_provider_for,
    pinned_alloc,
    provider_by_kind,
    providers,
    register_provider,
    target_provider_for,
)
from statestream.providers.jax import JaxProvider, expand_pytree, rebuild_pytree
from statestream.providers.numpy import NumpyProvider
from statestream.providers.stateful import (
    CompiledModuleAdapter,
    JaxKeyAdapter,
    NnxAdapter,
    NumpyBitGeneratorAdapter,
    NumpyGeneratorAdapter,
    NumpyRandomStateAdapter,
    PythonRandomAdapter,
    TorchGeneratorAdapter,
)
from statestream.providers.torch import TorchProvider

__all__ = [
    "ArrayProvider",
    "Destination",
    "JaxProvider",
    "NumpyProvider",
    "PreparedArray",
    "ProviderCapabilities",
    "StateAdapter",
    "TorchProvider",
    "adapter_by_name",
    "adapter_for",
    "adapters",
    "array_provider_for",
    "box_slices",
    "chunk_of_host_array",
    "expand_pytree",
    "find_box",
    "module_provider_for",
    "optimizer_provider_for",
    "pinned_alloc",
    "provider_by_kind",
    "providers",
    "rebuild_pytree",
    "register_adapter",
    "register_provider",
    "target_provider_for",
]

register_provider(NumpyProvider())
register_provider(TorchProvider(), module="torch")
register_provider(JaxProvider(), module="jax")
for _adapter in (NumpyGeneratorAdapter(), NumpyBitGeneratorAdapter(), NumpyRandomStateAdapter(),
                 PythonRandomAdapter(), TorchGeneratorAdapter(), CompiledModuleAdapter(),
                 JaxKeyAdapter(), NnxAdapter()):
    register_adapter(_adapter)
