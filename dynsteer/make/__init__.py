"""Making steering vectors: from contrastive pairs on a live engine (difference of means, PCA), from a probe file,
from an SAE's decoder rows. Each returns :class:`~dynsteer.vectors.made.SteeringVectors`, whose ``save()`` writes a
vector file that ``DynsteerConfig(vectors=...)``, ``dynsteer.load_vector`` and the server load.

Example:
    >>> from dynsteer.make import from_pairs                                          # doctest: +SKIP
    >>> from dynsteer.vectors.pairs import read_pairs                                 # doctest: +SKIP
    >>> sv = from_pairs(steerer, read_pairs("pairs.jsonl"), layers=[12, 14])          # doctest: +SKIP
    >>> sv.save("sentiment.safetensors")                                              # doctest: +SKIP
"""

from dynsteer.make.contrast import from_pairs, make_caa, make_pca
from dynsteer.make.files import from_probe, from_sae
from dynsteer.vectors.made import SteeringVectors

__all__ = ["SteeringVectors", "from_pairs", "from_probe", "from_sae", "make_caa", "make_pca"]
