"""Observability: metric definitions and recording (Ray's metrics API), the Grafana dashboard, the
Prometheus scrape config and alert rules, all as code; ``rdserve dashboards`` and ``rdserve
observability`` are their commands."""
