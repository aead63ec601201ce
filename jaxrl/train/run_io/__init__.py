"""Run I/O: checkpoints, metrics, log sinks, plots and the memory report (``jaxrl memory``)."""
