"""Kubernetes manifests rendered from an rdserve config (``rdserve k8s render``): a KubeRay ``RayService``
whose ``serveConfigV2`` is :func:`cluster.deploy.serve_config.serve_config`, a ``PodMonitor`` for the Ray
metrics port, and the namespace. ``k8s/`` at the project root holds rendered examples and the README.
"""
