"""A stand-in for Colab's ``google.colab``, only for running examples/colab_cifar10.ipynb in a test.

tests/examples/test_colab_notebook.py puts ``tests/support/fake_colab`` on the kernel's path, so
the notebook's ``from google.colab import drive`` runs as written. Only ``drive.mount`` exists;
nothing else of Colab is imitated (``google`` stays a namespace package: google-auth, gcsfs...).
"""
