"""Run by tests/test_compile_cache_procs.py on each of several processes: maxlite's compilation cache
on, jax.distributed as the trainer starts it, one sharded program; prints one JSON line saying whether
this process found the program in the persistent cache, and what it computed."""

import json
import sys
import types

from jax._src import monitoring

from maxlite import mesh as mesh_lib
from maxlite.compile_cache import enable_compilation_cache

events: list[str] = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
enable_compilation_cache(types.SimpleNamespace(jax_cache_dir=sys.argv[1]))
mesh_lib.initialize_distributed()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

mesh = Mesh(np.asarray(jax.devices()), ("all",))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("all")),
                                           np.arange(4 * jax.local_device_count(), dtype=np.float32))
del events[:]  # the connect's own programs above: only the probe's below counts
y = jax.jit(lambda v: (jax.numpy.sin(v) * 3.0).sum(), out_shardings=NamedSharding(mesh, P()))(x)
print(json.dumps({"process": jax.process_index(), "value": float(y),
                  "hit": "/jax/compilation_cache/cache_hits" in events}), flush=True)
