"""What the course trains: ``data`` (scikit-learn's digits offline, CIFAR-10 / MNIST from files a
user has) and ``models`` (the MLPs and CNNs of the labs). The lowest layer with ``launcher``."""
