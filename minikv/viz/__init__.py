"""minikv.viz"""
