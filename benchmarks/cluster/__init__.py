"""Replicas behind HAProxy: sustained load with 1, 2 and 3 replicas, and a replica killed."""
