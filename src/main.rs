//! The `nmt` binary: parse the command line and dispatch; errors become one line on stderr.

use clap::Parser;
use nmt::cli::{Cli, Command};
use nmt::commands;
use nmt::runtime::{keep_freed_memory, on_worker, one_candle_pool_thread};

fn main() {
    let cli = Cli::parse();
    if let Err(e) = nmt::ops::cpu::Isa::cap_from_env() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    // Tensor work frees and reallocates the same large blocks: keep them. Text work
    // (tokenizer training, preparing a corpus) allocates small strings and needs no more; the
    // commands that decode with a loaded model keep them once it is loaded
    // (`keep_freed_memory_after_load`).
    match cli.command {
        Command::Tokenize(_) | Command::Prepare(_) => {}
        Command::Translate(_) | Command::Eval(_) | Command::Serve(_) => {}
        Command::Train(_) | Command::Average(_) => keep_freed_memory(),
    }
    one_candle_pool_thread();
    let result = match cli.command {
        // The server's thread waits on its connections for its whole life, so it must not be
        // one of rayon's workers, which its models decode on.
        Command::Serve(args) => commands::serve(args).map(|()| 0),
        command => on_worker(move || run(command)),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    }
}

fn run(command: Command) -> anyhow::Result<i32> {
    match command {
        Command::Tokenize(cmd) => commands::tokenize(cmd).map(|()| 0),
        Command::Prepare(args) => commands::prepare(args).map(|()| 0),
        Command::Train(args) => commands::train(*args),
        Command::Translate(args) => commands::translate(args).map(|()| 0),
        Command::Average(args) => commands::average(args).map(|()| 0),
        Command::Eval(args) => commands::eval(args).map(|()| 0),
        Command::Serve(args) => commands::serve(args).map(|()| 0),
    }
}
