"""Vectors: values and their wire form, the steering-vector file, and the pure parts of making one.

* :mod:`~dynsteer.vectors.values`: conversion (:func:`as_vector`), the packed wire form, the pydantic ``Vector`` type;
* :mod:`~dynsteer.vectors.fileformat`: the ``dynsteer.vector/1`` safetensors file (:func:`save_vector`,
  :func:`load_vector`);
* :mod:`~dynsteer.vectors.pairs`, :mod:`~dynsteer.vectors.directions`, :mod:`~dynsteer.vectors.sae`,
  :mod:`~dynsteer.vectors.made`: contrastive pair data, difference of means and PCA, SAE decoders, and the made
  vectors with their provenance. :mod:`dynsteer.make` runs them on an engine (``dynsteer vector make``).
"""

from dynsteer.vectors.fileformat import VECTOR_FILE_FORMAT, load_vector, save_vector
from dynsteer.vectors.values import Vector, as_vector, pack_vector, unpack_vector

__all__ = ["VECTOR_FILE_FORMAT", "Vector", "as_vector", "load_vector", "pack_vector", "save_vector",
           "unpack_vector"]
