//! nmt: neural machine translation in one binary. The library holds everything; the binary
//! only parses the command line (see `cli`) and dispatches.

pub mod align;
pub mod checkpoint;
pub mod cli;
pub mod commands;
pub mod data;
pub mod decode;
pub mod eval;
pub mod io;
pub mod model;
pub mod ops;
pub mod plot;
pub mod progress;
pub mod rng;
pub mod runtime;
pub mod serve;
pub mod train;
pub mod translate;
