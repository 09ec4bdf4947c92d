"""minikv.bench"""
