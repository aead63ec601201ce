"""The ground floor: device placement (mesh, spmd), multi-host launch, process shutdown and the
configuration error every layer may raise. Nothing here imports another jaxrl package."""
