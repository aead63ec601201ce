"""A folder put first on ``PYTHONPATH`` of a vLLM server jaxrl starts (``api_server.py``): its
``sitecustomize`` runs at the start of every Python process of the server's process tree."""
