"""Routing policies: one small file per policy, all behind ``base.RoutingPolicy``; ``runner`` wraps them."""
