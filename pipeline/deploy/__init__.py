"""The Kubernetes stage: deploy targets, rendered kustomize overlays, and the kubectl rollout."""
