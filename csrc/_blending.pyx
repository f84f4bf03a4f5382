"""Kernels behind Megatron's blending indices (helpers.cpp ``build_blending_indices`` and
``build_exhaustive_blending_indices``), with the same floating-point expressions evaluated in the
same order so the result is bit-identical, 64-bit sample counters, and any number of datasets.

Sample s goes to the dataset with the largest error ``weight * max(s, 1) - taken_so_far``; ties go
to the lowest dataset index (strict ``>`` while scanning upwards).
"""

from libc.float cimport DBL_MAX
from libc.stdint cimport int16_t, int32_t, int64_t
from libc.stdlib cimport calloc, free, malloc


ctypedef fused dataset_t:
    int16_t
    int32_t


def build_blending_indices(const double[::1] weights, dataset_t[::1] dataset_index,
                           int64_t[::1] dataset_sample_index, double[::1] taken, int64_t start):
    """Fill both outputs for samples ``start .. start + len(dataset_index)`` drawn greedily by
    ``weights``; ``taken`` (samples so far per dataset, zeros at ``start`` 0) is carried over, so
    consecutive calls continue one blend."""
    cdef int64_t num_datasets = weights.shape[0]
    cdef int64_t size = dataset_index.shape[0]
    cdef int64_t sample, dataset, best
    cdef double scale, error, best_error
    # Counts held as doubles (exact below 2**53) spare a conversion per dataset and sample.
    cdef const double* w = &weights[0]
    cdef double* t = &taken[0]
    if taken.shape[0] != num_datasets:
        raise ValueError("taken needs one count per dataset")
    with nogil:
        for sample in range(size):
            scale = max(<double> (start + sample), 1.0)
            best = 0
            best_error = w[0] * scale - t[0]
            for dataset in range(1, num_datasets):
                error = w[dataset] * scale - t[dataset]
                if error > best_error:
                    best_error = error
                    best = dataset
            dataset_index[sample] = <dataset_t> best
            dataset_sample_index[sample] = <int64_t> t[best]
            t[best] += 1.0


def build_exhaustive_blending_indices(const int64_t[::1] sizes, dataset_t[::1] dataset_index,
                                      int64_t[::1] dataset_sample_index):
    """Fill both outputs with exactly ``sizes[d]`` (> 0) samples of every dataset d, in the
    greedy order of weights ``sizes / sum(sizes)``; a dataset leaves the race once it is spent."""
    cdef int64_t num_datasets = sizes.shape[0]
    cdef int64_t total = dataset_index.shape[0]
    cdef int64_t sample, dataset, k, best, best_k, num_active
    cdef double scale, error, best_error
    cdef int64_t* taken = <int64_t*> calloc(max(num_datasets, 1), sizeof(int64_t))
    cdef double* weights = <double*> malloc(max(num_datasets, 1) * sizeof(double))
    # Unspent datasets in increasing order, so the first maximum found is the lowest index.
    cdef int64_t* active = <int64_t*> malloc(max(num_datasets, 1) * sizeof(int64_t))
    if taken == NULL or weights == NULL or active == NULL:
        free(taken)
        free(weights)
        free(active)
        raise MemoryError()
    with nogil:
        for dataset in range(num_datasets):
            weights[dataset] = sizes[dataset] / <double> total
            active[dataset] = dataset
        num_active = num_datasets
        for sample in range(total):
            scale = max(<double> sample, 1.0)
            best = -1
            best_k = -1
            best_error = -DBL_MAX
            for k in range(num_active):
                dataset = active[k]
                error = weights[dataset] * scale - <double> taken[dataset]
                if error > best_error:
                    best_error = error
                    best = dataset
                    best_k = k
            dataset_index[sample] = <dataset_t> best
            dataset_sample_index[sample] = taken[best]
            taken[best] += 1
            if taken[best] == sizes[best]:
                num_active -= 1
                for k in range(best_k, num_active):
                    active[k] = active[k + 1]
    free(taken)
    free(weights)
    free(active)
