"""Requester: agent sessions, the fan-out client, LSE merge, the route/fetch/local predicate.

Built by the requester issue; nothing here yet but the package boundary.
"""
