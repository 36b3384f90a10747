//! Data: tokenisation, data-set loaders, fetching registry-packaged data sets.
