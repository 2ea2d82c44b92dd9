"""Flower client side of fedddl: the ClientApp (``clients.client_app:app``) and helpers."""
