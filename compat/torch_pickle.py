"""PyTorch's ``torch.save`` files (.pt) read and written with numpy alone, and read without
running any code from the file.

A .pt file is a zip archive of ``<name>/data.pkl``, a pickle in which each tensor refers to a
storage by a persistent id, and ``<name>/data/<key>``, each storage's little-endian bytes.
Megatron keeps its checkpoints so (``model_optim_rng.pt``: the state dicts, the iteration and
the ``args`` Namespace).

Reading never imports or calls what the pickle names: ``find_class`` answers from an
allow-list (dicts, tensors, storages, dtypes, argparse.Namespace, a few builtins) with our own
stand-ins, keeps the classes of Megatron, MindSpeed, NumPy and PyTorch's other modules as inert
records (an enum in ``args``, a NumPy random state: never called, never imported), and refuses
every other global, e.g. ``os.system``, with a CheckpointError naming it. This is the reader on
every framework, so a MindSpore-only install reads Megatron checkpoints without torch.

Writing emits protocol-2 pickle opcodes for what checkpoints hold (dict, OrderedDict, list,
tuple, str, int, float, bool, None, argparse.Namespace, torch dtypes, tensors as HostTensor)
in the layout ``torch.load`` reads, and for the few objects of other libraries a checkpoint's
metadata names (``Global``, ``Call``, ``Instance``: compat/torch_dist.py's torch.Size and
checkpoint metadata), so that nothing of those libraries is needed to write them.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import pickle
import struct
import zipfile

import numpy as np

from mindspeed_core.errors import CheckpointError
from mindspeed_core.tensor_files import HostTensor

# torch's storage classes <-> (numpy dtype, facade dtype name); bfloat16 as uint16 patterns
STORAGES = {
    "FloatStorage": (np.float32, "float32"), "DoubleStorage": (np.float64, "float64"),
    "HalfStorage": (np.float16, "float16"), "BFloat16Storage": (np.uint16, "bfloat16"),
    "LongStorage": (np.int64, "int64"), "IntStorage": (np.int32, "int32"), "ShortStorage": (np.int16, "int16"),
    "CharStorage": (np.int8, "int8"), "ByteStorage": (np.uint8, "uint8"), "BoolStorage": (np.bool_, "bool"),
}
_STORAGE_OF = {dtype: name for name, (_, dtype) in STORAGES.items()}
DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
# modules whose classes may appear in a Megatron checkpoint's args or rng state: kept inert
_INERT_MODULES = ("megatron", "mindspeed", "mindspeed_llm", "numpy", "torch", "transformer_engine")


class TorchDType:
    """A torch dtype named in a pickle (``args.params_dtype``): its name, e.g. "bfloat16"."""

    def __init__(self, name: str):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, TorchDType) and other.name == self.name

    def __hash__(self):
        return hash(self.name)

    def __repr__(self):
        return f"torch.{self.name}"


class Opaque:
    """What the pickle built from a class we keep inert: its qualified name, the arguments and
    state it was given; nothing of the named class ran."""

    qualified = "?"

    def __new__(cls, *args, **kwargs):
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<{self.qualified}{self.args!r}>"


def _opaque(module: str, name: str) -> type:
    return type(name, (Opaque,), {"qualified": f"{module}.{name}", "__module__": "compat.torch_pickle"})


class _Storage:
    def __init__(self, name: str):
        self.name = name


def _rebuild_tensor(storage, offset, size, stride, *rest):
    array, dtype = storage
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if any(s < 0 for s in size + stride) or offset < 0:
        raise CheckpointError("a tensor of the .pt file has a negative size, stride or offset")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else offset - 1
    if last >= array.size:
        raise CheckpointError(f"a tensor of the .pt file reaches element {last} of a storage of {array.size}")
    view = np.lib.stride_tricks.as_strided(array[offset:], size, [s * array.itemsize for s in stride]) if all(size) \
        else np.zeros(size, array.dtype)
    return HostTensor(np.array(view), dtype)


def _rebuild_parameter(data, requires_grad=False, hooks=None, *rest):
    return data


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("argparse", "Namespace"): argparse.Namespace,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "complex"): complex,
    ("builtins", "slice"): slice, ("_codecs", "encode"): lambda text, encoding="utf-8": text.encode(encoding),
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, path: str):
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.path = archive, prefix, path
        self.storages: dict[str, tuple] = {}

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and name in STORAGES:
            return _Storage(name)
        if module == "torch" and name in DTYPES:
            return TorchDType(name)
        if module.split(".")[0] in _INERT_MODULES:
            return _opaque(module, name)
        raise CheckpointError(f"{self.path}: refusing to load it: its pickle calls {module}.{name}, which is not a "
                              f"tensor, a number, a container or argparse.Namespace (a .pt file is read without "
                              f"running code from it)")

    def persistent_load(self, pid):
        if self.archive is None:
            raise CheckpointError(f"{self.path}: a plain pickle that refers to tensor storages")
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise CheckpointError(f"{self.path}: a persistent id {pid!r:.80} is not a tensor storage")
        _, kind, key, _, numel = pid
        if key not in self.storages:
            dtype, name = STORAGES[kind.name]
            try:
                raw = self.archive.read(f"{self.prefix}data/{key}")
            except KeyError:
                raise CheckpointError(f"{self.path}: storage {key} is missing from the archive") from None
            if len(raw) < int(numel) * np.dtype(dtype).itemsize:
                raise CheckpointError(f"{self.path}: storage {key} holds {len(raw)} bytes, less than its {numel} "
                                      f"elements")
            self.storages[key] = (np.frombuffer(raw, dtype, count=int(numel)).astype(np.dtype(dtype).newbyteorder("<")),
                                  name)
        return self.storages[key]


def load(path: str):
    """The object saved in ``path`` with its tensors as HostTensor (numpy data + dtype name)."""
    return _load_archive(path, path)


def loads(data: bytes, where: str):
    """``load`` of a torch.save archive held in ``data`` (``where`` names it in errors)."""
    return _load_archive(io.BytesIO(data), where)


def load_pickle(path: str):
    """A plain pickle file (no archive, no tensors), read with the same allow-list: what the
    named classes of torch and Megatron built comes back as inert Opaque records."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        return _Unpickler(data, None, "", path).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, struct.error) as exc:
        raise CheckpointError(f"{path}: its pickle is malformed ({type(exc).__name__}: {exc})") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None


def _load_archive(source, path: str):
    try:
        with zipfile.ZipFile(source) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pickles) != 1:
                raise CheckpointError(f"{path} is not a torch.save file (no single <name>/data.pkl in the archive)")
            prefix = pickles[0][:-len("data.pkl")]
            if archive.namelist().count(prefix + "byteorder") and archive.read(prefix + "byteorder") != b"little":
                raise CheckpointError(f"{path} was saved big-endian: not supported")
            return _Unpickler(archive.read(pickles[0]), archive, prefix, path).load()
    except zipfile.BadZipFile as exc:
        raise CheckpointError(f"{path} is not a complete .pt file ({exc}): truncated or not a torch.save archive") \
            from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, struct.error) as exc:
        raise CheckpointError(f"{path}: its pickle is malformed ({type(exc).__name__}: {exc})") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None


# ---- writing ----------------------------------------------------------------------------------

class Global:
    """A name written as a pickle GLOBAL (a class or function of another library)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


class Call:
    """``func(*args)`` when unpickled (REDUCE): e.g. torch.Size((2, 3))."""

    def __init__(self, func: Global, args: tuple):
        self.func, self.args = func, args


class Instance:
    """An instance of ``cls`` built without its constructor and given ``state`` (NEWOBJ, BUILD),
    as pickle saves a dataclass."""

    def __init__(self, cls: Global, state):
        self.cls, self.state = cls, state


class _Writer:
    def __init__(self):
        self.out = bytearray(b"\x80\x02")  # PROTO 2
        self.storages: list[bytes] = []

    def _global(self, module: str, name: str) -> None:
        self.out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"

    def _str(self, text: str) -> None:
        data = text.encode("utf-8")
        self.out += b"X" + struct.pack("<I", len(data)) + data

    def _items(self, pairs) -> None:
        pairs = list(pairs)
        if pairs:
            self.out += b"("
            for key, value in pairs:
                self.save(key)
                self.save(value)
            self.out += b"u"  # SETITEMS

    def _tuple(self, values) -> None:
        self.out += b"("
        for v in values:
            self.save(v)
        self.out += b"t"

    def save(self, obj) -> None:
        if obj is None:
            self.out += b"N"
        elif obj is True or obj is False:
            self.out += b"\x88" if obj else b"\x89"
        elif isinstance(obj, (int, np.integer)):
            obj = int(obj)
            if -2**31 <= obj < 2**31:
                self.out += b"J" + struct.pack("<i", obj)
            else:
                data = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
                self.out += b"\x8a" + bytes([len(data)]) + data  # LONG1
        elif isinstance(obj, (float, np.floating)):
            self.out += b"G" + struct.pack(">d", float(obj))
        elif isinstance(obj, str):
            self._str(obj)
        elif isinstance(obj, TorchDType):
            self._global("torch", obj.name)
        elif isinstance(obj, Global):
            self._global(obj.module, obj.name)
        elif isinstance(obj, Call):
            self.save(obj.func)
            self._tuple(obj.args)
            self.out += b"R"  # REDUCE
        elif isinstance(obj, Instance):
            self.save(obj.cls)
            self.out += b")\x81"  # EMPTY_TUPLE NEWOBJ
            self.save(obj.state)
            self.out += b"b"  # BUILD
        elif isinstance(obj, (HostTensor, np.ndarray)):
            self._tensor(obj if isinstance(obj, HostTensor) else HostTensor(obj))
        elif isinstance(obj, collections.OrderedDict):
            self._global("collections", "OrderedDict")
            self.out += b")R"  # EMPTY_TUPLE REDUCE
            self._items(obj.items())
        elif isinstance(obj, dict):
            self.out += b"}"
            self._items(obj.items())
        elif isinstance(obj, list):
            self.out += b"]"
            if obj:
                self.out += b"("
                for v in obj:
                    self.save(v)
                self.out += b"e"  # APPENDS
        elif isinstance(obj, tuple):
            self._tuple(obj)
        elif isinstance(obj, argparse.Namespace):
            self._global("argparse", "Namespace")
            self.out += b")\x81}"  # EMPTY_TUPLE NEWOBJ EMPTY_DICT
            self._items(vars(obj).items())
            self.out += b"b"  # BUILD
        else:
            raise CheckpointError(f"cannot write a {type(obj).__name__} into a .pt file")

    def _tensor(self, t: HostTensor) -> None:
        if t.dtype not in _STORAGE_OF:
            raise CheckpointError(f"cannot write a {t.dtype} tensor into a .pt file")
        array = np.ascontiguousarray(t.array).astype(np.dtype(t.array.dtype).newbyteorder("<"), copy=False)
        key = str(len(self.storages))
        self.storages.append(array.tobytes())
        self._global("torch._utils", "_rebuild_tensor_v2")
        self.out += b"("
        self.out += b"("  # the storage's persistent id
        self._str("storage")
        self._global("torch", _STORAGE_OF[t.dtype])
        self._str(key)
        self._str("cpu")
        self.save(int(array.size))
        self.out += b"tQ"  # TUPLE BINPERSID
        self.save(0)
        self._tuple(array.shape)
        strides, step = [], 1
        for n in reversed(array.shape):
            strides.insert(0, step)
            step *= n
        self._tuple(strides)
        self.out += b"\x89"  # requires_grad False
        self._global("collections", "OrderedDict")
        self.out += b")R"  # no backward hooks
        self.out += b"tR"


def pickled(obj) -> bytes:
    """``obj`` as a plain pickle (no tensors)."""
    writer = _Writer()
    writer.save(obj)
    if writer.storages:
        raise CheckpointError("a plain pickle cannot hold tensors")
    return bytes(writer.out + b".")


def _archive(target, obj, stem: str) -> None:
    writer = _Writer()
    writer.save(obj)
    writer.out += b"."
    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{stem}/data.pkl", bytes(writer.out))
        archive.writestr(f"{stem}/byteorder", "little")
        for key, data in enumerate(writer.storages):
            archive.writestr(f"{stem}/data/{key}", data)
        archive.writestr(f"{stem}/version", "3\n")


def dumps(obj) -> bytes:
    """``obj`` as the bytes torch.save writes into a buffer (its archive named "archive")."""
    buffer = io.BytesIO()
    _archive(buffer, obj, "archive")
    return buffer.getvalue()


def save(path: str, obj) -> None:
    """Write ``obj`` as torch.save would (tensors: HostTensor or numpy arrays), atomically."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        _archive(tmp, obj, os.path.splitext(os.path.basename(path))[0] or "archive")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
