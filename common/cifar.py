"""CIFAR-100's python pickles (cifar-100-python/{train,test,meta}), read without running code:
only what the official files hold is built, and each field is checked before torch sees it."""
import os
import pickle
import reprlib

import numpy as np
import torch

from .run import UserError


def cifar100_folder(data_dir):
    return os.path.join(data_dir, "cifar-100-python")


def read_cifar100_pickles(data_dir, train):
    """(uint8 images N x 3 x 32 x 32, int64 labels, class names) of the training or test set."""
    folder = cifar100_folder(data_dir)
    path = os.path.join(folder, "train" if train else "test")
    if not os.path.isdir(folder):
        raise UserError(f"CIFAR-100 not found: expected {folder}/{{train,test,meta}}; "
                        "pass --download to fetch it, or --data-dir to point at it")
    batch = unpickle(path)
    meta = os.path.join(folder, "meta")
    names = unpickle(meta).get(b"fine_label_names")  # Python 2 strings: bytes here
    check_list(meta, "fine_label_names", names, "a list of 100 class names",
               lambda name: isinstance(name, (bytes, str)), length=100)
    classes = [n.decode("latin-1") if isinstance(n, bytes) else n for n in names]  # torchvision's
    data, labels = batch.get(b"data"), batch.get(b"fine_labels")
    if data is None or labels is None:
        raise UserError(f"{path}: not a CIFAR-100 pickle (needs b'data' and b'fine_labels'); "
                        "re-download with --download")
    # checked before torch sees them: it would truncate a float, overflow on a huge int, refuse
    # a string with a traceback (bool is an int, but never a label)
    check_list(path, "fine_labels", labels, "a list of labels 0 to 99",
               lambda y: type(y) is int and 0 <= y < 100)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 \
            or data.shape != (len(labels), 3 * 32 * 32):
        found = (f"dtype {data.dtype}, shape {data.shape}" if isinstance(data, np.ndarray)
                 else what(data))
        raise field_error(path, "data", f"a uint8 array of {len(labels)} x {3 * 32 * 32} (an "
                          "image per label)", found)
    return (torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()),
            torch.tensor(labels, dtype=torch.int64), classes)


def check_list(path, field, items, expected, valid, length=None):
    """One line naming `field` of the pickle `path` unless it is a non-empty list (of `length`
    items) whose every item is `valid`."""
    if not isinstance(items, list) or not items or length not in (None, len(items)):
        raise field_error(path, field, expected, what(items))
    for i, item in enumerate(items):
        if not valid(item):
            raise field_error(path, field, expected, f"{what(item)} at index {i}")


def what(value):
    """"5 (int)": a value for an error line, cut short (reprlib: a crafted one may be huge or
    nested past the recursion limit)."""
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def field_error(path, field, expected, found):
    return UserError(f"{path}: field b'{field}' must be {expected}; found {found}; "
                     "re-download with --download")


class CifarUnpickler(pickle.Unpickler):
    """Builds only what the official CIFAR-100 files hold: dicts, lists, bytes, strings and
    numbers (made by opcodes, never looked up) and numpy arrays.  Any other class or function,
    the way a crafted pickle runs code, is refused."""

    _reconstruct = np.zeros(0).__reduce__()[0]  # numpy's own, under whichever module name
    ALLOWED = {("numpy.core.multiarray", "_reconstruct"): _reconstruct,  # as the files name it
               ("numpy._core.multiarray", "_reconstruct"): _reconstruct,  # numpy 2's name
               ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}

    def __init__(self, file, path):
        super().__init__(file, encoding="bytes")
        self.path = path

    def find_class(self, module, name):
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            asked = f"{module}.{name}"[:100]  # repr: a crafted name may hold line breaks
            raise UserError(f"{self.path}: refused: the pickle asks for {asked!r}, which "
                            "CIFAR-100 files never hold (it could run code); re-download "
                            "with --download") from None


def unpickle(path):
    if not os.path.isfile(path):
        raise UserError(f"CIFAR-100 file missing: {path}; pass --download to fetch the data set")
    try:
        with open(path, "rb") as f:
            obj = CifarUnpickler(f, path).load()
    except UserError:
        raise
    except Exception as exc:  # truncated, empty or not a pickle at all
        raise UserError(f"{path}: unreadable CIFAR-100 pickle ({exc.__class__.__name__}: {exc}); "
                        "re-download with --download") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}: not a CIFAR-100 pickle (holds a {type(obj).__name__}, not a "
                        "dict)")
    return obj
